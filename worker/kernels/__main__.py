"""``python -m worker.kernels``: build (or find) the CPU kernels now, and say which; exit 0 either way."""

from worker.kernels import _build_directory, cpu_kernels_available

if __name__ == "__main__":
    if cpu_kernels_available():
        print(f"tpserve CPU kernels ready in {_build_directory()}")
    else:
        print("tpserve CPU kernels not available on this machine; torch's GEMMs will be used")
