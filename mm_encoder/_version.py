"""The package's version, written here only: the build reads it (pyproject.toml, hatch's version
source) and so does the package (`mm_encoder.__version__`, `mm-encoder --version`). What a version
number promises: docs/versioning.md."""

__version__ = "0.3.0"
