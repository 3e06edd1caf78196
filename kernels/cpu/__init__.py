"""numba kernels of the CPU path's steps beside the matmuls (kernels/quant/intdot_numba.py): the float64 elementwise
ops and one-query-row paged attention, each with the bits of its torch reference (docs/ACCURACY.md)."""
