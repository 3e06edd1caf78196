"""The width of a tile of kernels/quant/intdot.py's repacked integers: output rows per tile, one work item of
the numba kernels (kernels/quant/intdot_kernels.py, which unroll their loops over it as a compile-time
constant) and of their callers (intdot.py, intdot_numba.py); its own module so that neither imports the other."""
TILE = 64
