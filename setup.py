from setuptools import find_packages, setup

setup(
    name="taskrt",
    version="0.1.0",
    description="A Legion-style task runtime in Python with a FlexFlow-style SOAP optimizer",
    packages=find_packages(include=["taskrt*", "ops*", "strategies*", "apps*", "tools*"]),
    # the shipped machine models, which load_machine finds beside strategies/machine_model.py
    package_data={"strategies": ["machines/*.json", "machines/README.md"]},
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        "numba>=0.58",
        "mpi4py>=4.0",   # (Comm.handle, which taskrt/mpi_native.py hands to MPI's C calls)
        "mpich>=4.1",
        "threadpoolctl>=3.1",
        "matplotlib>=3.5",   # (the demo's and tools' pictures)
    ],
    extras_require={
        "test": ["pytest>=7", "hypothesis>=6.80", "dask>=2023.1", "torch>=2.0"],
        "gpu": ["cupy-cuda12x>=13"],
    },
)
