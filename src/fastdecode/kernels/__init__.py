"""Hand-written compute kernels, each used only where no library kernel does the job (the module says why).

The bottom layer of the package: nothing here imports the weight formats, ``quant`` or
``loading``. ``abi`` declares the C library's functions and structures, ``build``
compiles it, ``paged`` describes a pass's rows in the paged KV cache, ``cpu`` loads the
library and wraps its calls (GEMM, attention, the fused decoder layer, block-format
projections), ``quant`` packs GGUF blocks for it and holds their torch reference.
"""
