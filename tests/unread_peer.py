"""Test helper for peers that stop reading: what the kernel holds of such a connection."""

from __future__ import annotations


def kernel_buffers() -> int:
    """About what the kernel holds of a connection that is not read: the sender's largest send
    buffer and the stuck peer's receive buffer (which the tests set small)."""
    try:
        with open("/proc/sys/net/ipv4/tcp_wmem") as f:
            wmem = int(f.read().split()[2])
    except (OSError, ValueError, IndexError):
        wmem = 4 << 20
    return wmem + (256 << 10)
