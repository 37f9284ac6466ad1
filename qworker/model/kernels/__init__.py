"""The matmuls and native kernels the model runs: native C++ kernels (csrc/), linear kinds,
GGUF block formats, and which kernel runs each shape (chosen by measurement)."""
