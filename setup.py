"""hvdtrain: synchronous data-parallel training for PyTorch and Keras on Horovod."""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"',
                    (Path(__file__).parent / "hvdtrain" / "__init__.py").read_text()).group(1)

setup(
    name="hvdtrain",
    version=version,
    description="Data-parallel training for PyTorch and Keras 3 on Horovod (MPI/Gloo ring all-reduce)",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    classifiers=[
        "Development Status :: 4 - Beta",
        "Intended Audience :: Science/Research",
        "Intended Audience :: Developers",
        "Operating System :: POSIX :: Linux",
        "Programming Language :: Python :: 3",
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3.12",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
    python_requires=">=3.10",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    # Horovod itself is built by scripts/setup.sh (it needs a C++17 patch for PyTorch >= 2.1).
    install_requires=["numpy>=1.26", "tqdm>=4.66", "tensorboardX>=2.6", "filelock>=3.12"],
    extras_require={
        # Any build of the framework: CPU or CUDA (requirements/constraints.txt pins this
        # project's CPU stack; GPU images bring their own CUDA PyTorch).
        "torch": ["torch>=2.1"],
        # Keras 3 on the TensorFlow backend (hvdtrain.keras needs Keras 3; README, "Keras 2 code").
        "keras": ["tensorflow>=2.16", "keras>=3.10"],
        # Keras 3 on the PyTorch backend (KERAS_BACKEND=torch).
        "keras-torch": ["keras>=3.10", "torch>=2.1"],
        # PyTorch Lightning 2.x: hvdtrain.torch.lightning's Trainer(strategy="horovod").
        "lightning": ["lightning>=2.0", "torch>=2.1"],
        "digits": ["scikit-learn>=1.4"],  # the demo dataset (--dataset digits)
        "test": ["pytest>=8", "scikit-learn>=1.4", "jsonschema>=4.18",
                 "kubernetes-validate>=1.30"],
        # hvdtrain launch --emit mpijob|trainjob writes YAML (Horovod depends on PyYAML too).
        "kubernetes": ["pyyaml>=5.4"],
        "bench": ["matplotlib>=3.8"],
        # The engines (hvdtrain.spark, hvdtrain.ray; docs/engines/): needed on the driver and
        # on every executor / worker node, beside Horovod.
        "spark": ["pyspark>=3.5"],
        "ray": ["ray[train]>=2.50"],
    },
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.cli:main"]},
)
