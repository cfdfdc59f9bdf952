"""How long each phase of one request took, and when the phases met: what the request log,
the server-timing header and the request's spans are made from. Both doors keep one."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Timing:
    """How long each phase took (server-timing, the request log) and, for its trace's spans,
    when the phases met: perf_counter readings, 0.0 for a phase the request never reached
    (the last try's, after a retry)."""

    started: float
    template: float = 0.0
    tokenize: float = 0.0
    route: float = 0.0
    queue: float = 0.0  # held at the gate, every engine of its pool saturated
    read_at: float = 0.0  # its body read, preprocessing begins
    routing_at: float = 0.0  # preprocessed, it asks the router
    routed_at: float = 0.0  # a backend chosen: connecting and sending
    sent_at: float = 0.0  # sent: waiting for the first byte
    connected: bool = False  # a new connection was opened for it (else one kept alive)
    answered_at: float = 0.0  # the backend's head arrived: relaying
    # Two hops (disaggregated serving): the prefill leg's request and its whole answer.
    prefill_at: float = 0.0
    prefilled_at: float = 0.0

    def header(self) -> bytes:
        return b"template;dur=%.3f, tokenize;dur=%.3f, route;dur=%.3f, queue;dur=%.3f" % (
            self.template * 1000,
            self.tokenize * 1000,
            self.route * 1000,
            self.queue * 1000,
        )
