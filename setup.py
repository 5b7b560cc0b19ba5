"""Packages are found from the folders, never listed: radixcache/ installs as `radixcache`, and the top-level
worker/, client/ and cluster/ folders (the product card names worker/ and client/) install under it as
`radixcache.worker`, `radixcache.client` and `radixcache.cluster`, every sub-package with them. Everything else
(metadata, dependencies, package data) is in pyproject.toml."""

from setuptools import find_packages, setup

# Import name -> the folder it is built from.
FOLDERS = {"radixcache": "radixcache", "radixcache.worker": "worker", "radixcache.client": "client",
           "radixcache.cluster": "cluster"}  # fmt: skip

packages = [
    f"{name}.{sub}" if sub else name for name, folder in FOLDERS.items() for sub in ["", *find_packages(folder)]
]
setup(packages=packages, package_dir=FOLDERS)
