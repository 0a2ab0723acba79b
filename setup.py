"""hvdtrain: synchronous data-parallel training for PyTorch and Keras on Horovod."""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"',
                    (Path(__file__).parent / "hvdtrain" / "__init__.py").read_text()).group(1)

setup(
    name="hvdtrain",
    version=version,
    description="Data-parallel training for PyTorch and tf.keras on Horovod (MPI/Gloo ring all-reduce)",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["hvdtrain", "hvdtrain.*"]),
    # Horovod itself is built by scripts/setup.sh (it needs a C++17 patch for PyTorch >= 2.1).
    install_requires=["numpy>=1.26,<2", "scikit-learn>=1.4", "tqdm>=4.66", "filelock>=3.12"],
    extras_require={
        "torch": ["torch==2.13.0"],
        "keras": ["tensorflow-cpu==2.15.1"],
        "test": ["pytest>=8"],
        "bench": ["matplotlib>=3.8"],
    },
    entry_points={"console_scripts": ["hvdtrain=hvdtrain.cli:main"]},
)
