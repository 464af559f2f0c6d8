# Included into llama.cpp's `project()` (from no-common.cmake for the plugin, directly for the
# llama-server peer of bench/build-llama-server.sh) when GGML_GANTRY_NO_AMX is set
# (.cargo/config.toml sets it for every cargo build of this workspace; llama-cpp-sys-2's build
# script hands GGML_* variables to CMake and rebuilds when they change).
#
# ggml's AMX kernels crash on Sapphire-Rapids-class CPUs: the first matrix product on weights
# repacked into the AMX buffer segfaults in ggml_backend_amx_mul_mat (llama.cpp issue #20824,
# closed without a fix; llama-server itself crashes the same way there). ggml compiles them
# only where __AMX_INT8__ is defined, which `-march=native` on such a CPU, or the
# `sapphirerapids` variant's `-mamx-int8`, predefines. `-U` cancels a built-in definition
# whatever its place on the command line, so every ggml CPU build here leaves AMX out and
# keeps the AVX-512 kernels and their repacked weights.
if(GGML_GANTRY_NO_AMX AND NOT MSVC AND CMAKE_SYSTEM_PROCESSOR MATCHES "^(x86_64|AMD64|amd64)$")
  add_compile_options(-U__AMX_INT8__ -U__AMX_TILE__ -U__AMX_BF16__)
endif()
