"""The Triton kernels: a GEMM that decodes quantized weights in registers, and an activation pre-pass.

Modules, from the descriptor to the launch:

- ``spec``: a scheme -> the constexpr parameters that specialise the kernels (pure, no triton);
- ``decode``: element and scale decoders as ``@triton.jit`` functions (integer bit operations);
- ``act_quant``: the activation quantization pre-pass, bit-identical to ``qscheme.emulation``;
- ``gemm``: the generic GEMM kernel and its split-K epilogue;
- ``configs``: tile configurations per problem size, optional autotuning, a cache;
- ``linear``: canonical tensors -> the kernels' layout, and the launches;
- ``compile_check``: compile every kernel variant for GPUs this machine lacks (no GPU needed);
- ``samples``: random canonical layers for tests, the compile check and benchmarks.

Importing this package imports nothing heavy; the submodules import triton (which imports fine
without a GPU).
"""
