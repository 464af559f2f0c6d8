# syntax=docker/dockerfile:1.7
# Gantry images, one multi-stage build:
#   docker build --target operator              -t gantry/operator .
#   docker build --target node                  -t gantry/node .
#   docker build --target engine-llama-cpp-cpu  -t gantry/engine-llama-cpp-cpu .
#   docker build --target engine-llama-cpp-cuda -t gantry/engine-llama-cpp-cuda .
#   docker build --target engine-native-cpu     -t gantry/engine-native-cpu .
#   docker build --target engine-native-cuda    -t gantry/engine-native-cuda .
#   docker build --target engine-onnx-cpu       -t gantry/engine-onnx-cpu .
# Dependencies are compiled in their own layer (cargo chef), so a source change rebuilds only
# Gantry's crates. Toolchain and base images are pinned; Cargo.lock is used as is (--locked).
# tests/python/test_dockerfile.py checks that every file a target copies is one the build makes.

ARG RUST_IMAGE=rust:1.95-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.6.3-devel-ubuntu24.04
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# Images run on CPUs other than the build host's: replace the workspace's
# `-C target-cpu=native` (.cargo/config.toml, for builds that run where they are made) with the
# x86-64 baseline, so llama.cpp is configured with GGML_NATIVE=OFF. Set in every build stage.
ARG IMAGE_RUSTFLAGS="-C target-cpu=x86-64"

# ---- toolchain with cargo-chef ----------------------------------------------------------------
FROM ${RUST_IMAGE} AS chef
ARG IMAGE_RUSTFLAGS
ENV RUSTFLAGS=${IMAGE_RUSTFLAGS}
RUN apt-get update \
 && apt-get install -y --no-install-recommends cmake clang libclang-dev musl-tools \
 && rm -rf /var/lib/apt/lists/* \
 && rustup target add x86_64-unknown-linux-musl \
 && cargo install --locked cargo-chef@0.1.73
WORKDIR /src

FROM chef AS planner
COPY . .
RUN cargo chef prepare --recipe-path recipe.json

# ---- CPU build: operator (static, musl), copier (static, musl), node and CPU plugin (glibc) ---
FROM chef AS build
COPY --from=planner /src/recipe.json recipe.json
# The recipe carries .cargo/config.toml, whose [env] has llama.cpp's CMake include the file that
# turns its `common` library off (engines/llama-cpp/cmake/no-common.cmake): it must exist for
# the dependency layer too.
COPY engines/llama-cpp/cmake/ engines/llama-cpp/cmake/
RUN cargo chef cook --release --locked --recipe-path recipe.json \
 && cargo chef cook --release --locked --target x86_64-unknown-linux-musl \
      -p gantry-operator -p gantry-copy --recipe-path recipe.json \
 && CARGO_TARGET_DIR=target/cpu-variants cargo chef cook --release --locked \
      -p gantry-engine-llama-cpp --features cpu-variants --recipe-path recipe.json
COPY . .
# The CPU plugin is the `cpu-variants` build: llama.cpp as shared libraries (found beside the
# plugin through its $ORIGIN run path) and ggml's CPU code once per x86-64 level, of which the
# plugin loads the best for the node's CPU at start (docs/engines.md, "CPU builds").
RUN cargo build --release --locked -p gantry-node -p gantry-engine-native -p gantry-engine-onnx --lib \
 && cargo build --release --locked --target x86_64-unknown-linux-musl -p gantry-operator -p gantry-copy \
 && CARGO_TARGET_DIR=target/cpu-variants cargo build --release --locked \
      -p gantry-engine-llama-cpp --features cpu-variants --lib \
 && mkdir -p /out/engines/llama_cpp/cpu \
 && cp -L target/release/gantry-node /out/gantry-node \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/manifest.json /out/engines/llama_cpp/cpu/manifest.json \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libgantry_engine_llama_cpp.so /out/engines/llama_cpp/cpu/libgantry_engine_llama_cpp.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libllama.so.0 /out/engines/llama_cpp/cpu/libllama.so.0 \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml.so.0 /out/engines/llama_cpp/cpu/libggml.so.0 \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-base.so.0 /out/engines/llama_cpp/cpu/libggml-base.so.0 \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-x64.so /out/engines/llama_cpp/cpu/libggml-cpu-x64.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-sse42.so /out/engines/llama_cpp/cpu/libggml-cpu-sse42.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-sandybridge.so /out/engines/llama_cpp/cpu/libggml-cpu-sandybridge.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-ivybridge.so /out/engines/llama_cpp/cpu/libggml-cpu-ivybridge.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-piledriver.so /out/engines/llama_cpp/cpu/libggml-cpu-piledriver.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-haswell.so /out/engines/llama_cpp/cpu/libggml-cpu-haswell.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-skylakex.so /out/engines/llama_cpp/cpu/libggml-cpu-skylakex.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-cannonlake.so /out/engines/llama_cpp/cpu/libggml-cpu-cannonlake.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-cascadelake.so /out/engines/llama_cpp/cpu/libggml-cpu-cascadelake.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-icelake.so /out/engines/llama_cpp/cpu/libggml-cpu-icelake.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-cooperlake.so /out/engines/llama_cpp/cpu/libggml-cpu-cooperlake.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-zen4.so /out/engines/llama_cpp/cpu/libggml-cpu-zen4.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-alderlake.so /out/engines/llama_cpp/cpu/libggml-cpu-alderlake.so \
 && cp -L target/cpu-variants/release/engines/llama_cpp/cpu/libggml-cpu-sapphirerapids.so /out/engines/llama_cpp/cpu/libggml-cpu-sapphirerapids.so \
 && mkdir -p /out/engines/native/cpu \
 && cp -L target/release/engines/native/cpu/manifest.json /out/engines/native/cpu/manifest.json \
 && cp -L target/release/engines/native/cpu/libgantry_engine_native.so /out/engines/native/cpu/libgantry_engine_native.so \
 && mkdir -p /out/engines/onnx/cpu \
 && cp -L target/release/engines/onnx/cpu/manifest.json /out/engines/onnx/cpu/manifest.json \
 && cp -L target/release/engines/onnx/cpu/libgantry_engine_onnx.so /out/engines/onnx/cpu/libgantry_engine_onnx.so \
 && cp -L target/x86_64-unknown-linux-musl/release/gantry-operator /out/gantry-operator \
 && cp -L target/x86_64-unknown-linux-musl/release/gantry-copy /out/copy

# ---- the ONNX plugin's run-time libraries --------------------------------------------------------
# ONNX Runtime and espeak-ng, which the plugin opens at run time and finds beside itself
# (engines/onnx/src/libs.rs), from the wheels the tests use, pinned by hash.
FROM ${PYTHON_IMAGE} AS onnx-runtime
COPY scripts/requirements-onnx-runtime.txt /tmp/requirements.txt
RUN python -m pip download --no-cache-dir --no-deps --require-hashes --only-binary=:all: \
      -d /tmp/wheels -r /tmp/requirements.txt \
 && for w in /tmp/wheels/*.whl; do python -m zipfile -e "$w" /tmp/x; done \
 && mkdir -p /out/onnx \
 && cp -L /tmp/x/onnxruntime/capi/libonnxruntime.so.1.32.0 /out/onnx/libonnxruntime.so.1 \
 && cp -L /tmp/x/espeakng_loader/libespeak-ng.so.1 /out/onnx/libespeak-ng.so.1 \
 && cp -LR /tmp/x/espeakng_loader/espeak-ng-data /out/onnx/espeak-ng-data

# ---- CUDA plugin build --------------------------------------------------------------------
FROM ${CUDA_IMAGE} AS build-cuda
ARG IMAGE_RUSTFLAGS
ENV RUSTFLAGS=${IMAGE_RUSTFLAGS}
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl cmake clang libclang-dev gcc g++ \
 && rm -rf /var/lib/apt/lists/* \
 && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal --default-toolchain 1.95.0
ENV PATH=/root/.cargo/bin:$PATH
WORKDIR /src
COPY . .
RUN cargo build --release --locked -p gantry-engine-llama-cpp --features cuda \
 && mkdir -p /out/engines/llama_cpp/cuda \
 && cp -L target/release/engines/llama_cpp/cuda/manifest.json /out/engines/llama_cpp/cuda/manifest.json \
 && cp -L target/release/engines/llama_cpp/cuda/libgantry_engine_llama_cpp.so /out/engines/llama_cpp/cuda/libgantry_engine_llama_cpp.so
# The native engine's CUDA plugin: cudarc opens cuBLAS and NVRTC at run time, so the image ships
# the CUDA image's own copies beside the library (its $ORIGIN run path finds them); the driver
# (libcuda) comes from the node, through the NVIDIA container runtime.
RUN cargo build --release --locked -p gantry-engine-native --features cuda --lib \
 && mkdir -p /out/engines/native/cuda \
 && cp -L target/release/engines/native/cuda/manifest.json /out/engines/native/cuda/manifest.json \
 && cp -L target/release/engines/native/cuda/libgantry_engine_native.so /out/engines/native/cuda/libgantry_engine_native.so \
 && cp -L /usr/local/cuda/lib64/libcublas.so.12 /out/engines/native/cuda/libcublas.so.12 \
 && cp -L /usr/local/cuda/lib64/libcublasLt.so.12 /out/engines/native/cuda/libcublasLt.so.12 \
 && cp -L /usr/local/cuda/lib64/libnvrtc.so.12 /out/engines/native/cuda/libnvrtc.so.12 \
 && cp -L /usr/local/cuda/lib64/libnvrtc-builtins.so.12.6 /out/engines/native/cuda/libnvrtc-builtins.so.12.6

# ---- operator: static binary on distroless/static, non-root ------------------------------------
FROM gcr.io/distroless/static-debian12:nonroot AS operator
COPY --from=build /out/gantry-operator /usr/local/bin/gantry-operator
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gantry-operator"]
CMD ["run"]

# ---- node: glibc + OpenMP runtime (llama.cpp), non-root ------------------------------------------
FROM debian:bookworm-slim AS node
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates libgomp1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /out/gantry-node /usr/local/bin/gantry-node
USER 65532:65532
ENTRYPOINT ["/usr/local/bin/gantry-node"]
CMD ["serve", "--config", "/etc/gantry/models.yaml", "--plugins-dir", "/opt/gantry/engines"]

# ---- plugin images: scratch, the plugin directory and the static /copy helper --------------------
# The operator's InitContainer runs `/copy /engines/llama_cpp/<backend> /opt/gantry/engines/...`.
FROM scratch AS engine-llama-cpp-cpu
COPY --from=build /out/copy /copy
COPY --from=build /out/engines/llama_cpp/cpu/ /engines/llama_cpp/cpu/
USER 65532:65532
ENTRYPOINT ["/copy"]

FROM scratch AS engine-llama-cpp-cuda
COPY --from=build /out/copy /copy
COPY --from=build-cuda /out/engines/llama_cpp/cuda/ /engines/llama_cpp/cuda/
USER 65532:65532
ENTRYPOINT ["/copy"]

# The native engine (safetensors): one library, portable x86-64; its bf16 kernel picks AVX-512
# BF16 at run time where the CPU has it (docs/engines.md, "The native engine").
FROM scratch AS engine-native-cpu
COPY --from=build /out/copy /copy
COPY --from=build /out/engines/native/cpu/ /engines/native/cpu/
USER 65532:65532
ENTRYPOINT ["/copy"]

# The ONNX engine (onnx: Piper voices for text to speech), with ONNX Runtime and espeak-ng (its
# library and data) beside it.
FROM scratch AS engine-onnx-cpu
COPY --from=build /out/copy /copy
COPY --from=build /out/engines/onnx/cpu/ /engines/onnx/cpu/
COPY --from=onnx-runtime /out/onnx/ /engines/onnx/cpu/
USER 65532:65532
ENTRYPOINT ["/copy"]

# The native engine on NVIDIA GPUs: the same library built as the cuda plugin, with the CUDA
# libraries it opens (cuBLAS, NVRTC) beside it. Its kernels are compiled at load for the GPU it
# finds, so one image serves every architecture from Turing on.
FROM scratch AS engine-native-cuda
COPY --from=build /out/copy /copy
COPY --from=build-cuda /out/engines/native/cuda/ /engines/native/cuda/
USER 65532:65532
ENTRYPOINT ["/copy"]
