"""Fetching media from untrusted URLs (SSRF-safe): see `fetcher.py` for the threat model."""

from .addresses import check_ip
from .fetcher import Fetcher
from .policy import Fetched, FetchPolicy

__all__ = ["FetchPolicy", "Fetched", "Fetcher", "check_ip"]
