# Included at the end of llama.cpp's `project()` call (CMAKE_PROJECT_llama.cpp_INCLUDE, set for
# every cargo build of this workspace in .cargo/config.toml; llama-cpp-sys-2's build script
# hands CMAKE_* variables to CMake).
#
# llama-cpp-2 asks llama-cpp-sys-2 for its default features, which build llama.cpp's `common`
# library (argument parsing, chat parsers, JSON-schema grammars, downloads): half of
# llama.cpp's compile time on two cores, and nothing the plugin calls (it uses llama.h alone;
# chat templates, grammars and tool calls are the node's). A normal variable shadows the
# `-DLLAMA_BUILD_COMMON=ON` cache entry for llama.cpp's `option()` and `if()` (policy CMP0077).
set(LLAMA_BUILD_COMMON OFF)

# No AMX kernels (they crash on some CPUs): see the file's comment.
include("${CMAKE_CURRENT_LIST_DIR}/no-amx.cmake")
