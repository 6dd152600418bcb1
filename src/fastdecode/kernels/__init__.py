"""Hand-written compute kernels, each used only where no library kernel does the job (the module says why)."""
