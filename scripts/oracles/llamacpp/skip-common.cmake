# Included right after llama.cpp's project() (CMAKE_PROJECT_llama.cpp_INCLUDE, set by
# oracle-venv.sh): llama-cpp-python forces LLAMA_BUILD_COMMON on in the cache, but its Python package
# loads only libllama and ggml. A directory-scope variable shadows that cache entry, so llama.cpp
# skips its common library (a third of the build) and the install of it.
set(LLAMA_BUILD_COMMON OFF)
