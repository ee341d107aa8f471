"""Which trainer ranks a maker sends to."""

from __future__ import annotations


def get_receivers_per_sender(sender_idx: int, num_senders: int, num_receivers: int) -> list[int]:
    """The reference design's modulo topology: the receiver ranks of maker ``sender_idx``.

    With more senders than receivers, sender i feeds receiver ``i % num_receivers``; with more
    receivers than senders, sender i feeds every receiver r with ``r % num_senders == i``; with
    equal counts, sender i feeds receiver i. Every receiver is fed by at least one sender.
    """
    if not 0 <= sender_idx < num_senders or num_receivers < 1:
        raise ValueError(f"sender {sender_idx} out of range for {num_senders} senders / {num_receivers} receivers")
    if num_senders >= num_receivers:
        return [sender_idx % num_receivers]
    return [r for r in range(num_receivers) if r % num_senders == sender_idx]


def receivers(routing: str, sender_idx: int, num_senders: int, num_receivers: int) -> list[int]:
    """Ranks maker ``sender_idx`` may send to: all of them for ``round_robin``, the modulo rule for ``modulo``."""
    if routing == "round_robin":
        return list(range(num_receivers))
    if routing == "modulo":
        return get_receivers_per_sender(sender_idx, num_senders, num_receivers)
    raise ValueError(f"unknown topology.routing {routing!r}; choose round_robin or modulo")
