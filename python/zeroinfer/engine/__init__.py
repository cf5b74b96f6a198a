"""The offline engine: requests, paged-cache accounting, the scheduler, the model runner and the
one-round-ahead (zero-overhead) pipeline that drives them."""
