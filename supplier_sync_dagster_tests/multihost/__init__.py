"""Tests across several hosts on one machine: network namespaces, worker hosts."""
