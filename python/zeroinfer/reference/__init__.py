"""Float64 pure-torch references: the test oracles for zeroinfer.ops.

They are written for clarity, not speed, and share no code with the kernels they check (the
engine never imports this package). Same file names as zeroinfer/ops/.
"""
