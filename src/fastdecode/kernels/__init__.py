"""Hand-written compute kernels, each used only where no library kernel does the job (the module says why).

The bottom layer of the package: nothing here imports the weight formats, ``quant`` or
``loading``. ``abi`` declares the C library's functions and structures, ``build``
compiles it, ``paged`` describes a pass's rows in the paged KV cache, ``cpu`` loads the
library (installing its loader in ``library``) and re-exports the wrappers of its calls:
``ops`` (GEMM, attention, norms, RoPE, one call at a time) and ``layer`` (block-format
projections, the fused decoder layer); ``experts`` runs a mixture of experts' FFN in one call;
``quant`` packs GGUF blocks for it and holds their torch reference.
"""
