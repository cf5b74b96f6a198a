// placeholder: replaced by the real CPU twin
