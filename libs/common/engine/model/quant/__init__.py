"""Weights kept in GGUF's quantized block formats and the products that read them.

`QuantWeight` holds a matrix as its file stored it (rows of blocks); `QuantLinear` (in
model/linear.py) multiplies by it with the C kernels of kernels.c (one translation unit:
it includes its parts, the *.h here), built per instruction set and chosen at start-up
(native.py).

May import: torch, numpy. Never the bus, transfer or a service.
"""
