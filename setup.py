"""Package discovery (everything else is in pyproject.toml).

The core's packages are found, not listed, so a new subpackage cannot be left out of a wheel.
The kernel adapters live in ``backends/`` beside the core and install as ``usp_hal.backends``;
pyproject.toml alone cannot combine discovery with that one mapped package.
"""
from setuptools import find_packages, setup

CORE = find_packages(include=["usp_hal", "usp_hal.*"], exclude=["usp_hal.backends", "usp_hal.backends.*"])

setup(
    packages=[*CORE, "usp_hal.backends"],
    package_dir={"usp_hal.backends": "backends"},
)
