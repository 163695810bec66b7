# Stand-ins for nvidia/cuda:*-devel and *-runtime where no registry is reachable: Debian 12 with
# this host's CUDA toolkit, for deploy/Dockerfile's BUILD_IMAGE and RUNTIME_IMAGE. The context is
# a directory holding `cuda/` (bin, nvvm, include, targets and lib with cudart, cuBLAS, cuBLASLt,
# NCCL), assembled by tests/deploy/test_docker.sh from /usr/local/cuda.
FROM debian:12 AS devel
COPY cuda /usr/local/cuda
RUN ln -s lib /usr/local/cuda/lib64 \
 && echo /usr/local/cuda/lib > /etc/ld.so.conf.d/cuda.conf && ldconfig
ENV PATH=/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

FROM debian:12-slim AS runtime
# the versioned names only (COPY would turn each unversioned link into a second copy)
COPY --from=devel /usr/local/cuda/lib/*.so.[0-9]* /usr/local/cuda/lib/
RUN ln -s lib /usr/local/cuda/lib64 \
 && echo /usr/local/cuda/lib > /etc/ld.so.conf.d/cuda.conf && ldconfig
