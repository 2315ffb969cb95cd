from setuptools import find_packages, setup

setup(
    name="taskrt",
    version="0.1.0",
    description="A Legion-style task runtime in Python with a FlexFlow-style SOAP optimizer",
    packages=find_packages(include=["taskrt*", "ops*", "strategies*", "apps*", "tools*"]),
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.24",
        "numba>=0.58",
        "mpi4py>=3.1.4",
        "mpich>=4.1",
        "threadpoolctl>=3.1",
    ],
    extras_require={
        "tools": ["matplotlib>=3.5"],
        "test": ["pytest>=7", "hypothesis>=6.80", "dask>=2023.1", "torch>=2.0", "matplotlib>=3.5"],
        "gpu": ["cupy-cuda12x>=13"],
    },
)
