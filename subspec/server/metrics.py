"""Prometheus metrics of the server (prometheus-client), in a registry of its own (one per app)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "subspec"


class Metrics:
    """Tokens, target forwards, tau, bytes streamed, prompt tokens prefilled vs reused from the cache, queue
    depth, requests by endpoint and status, request latency and time to first token, and the drafting rounds'
    timeline: rounds, their seconds by phase (draft, verify, verify_wait: the verify blocked on the offload tier) and
    the disk's busy seconds by phase (draft: read-ahead overlapped with drafting; verify): a dashboard divides their
    rates by the rounds' rate for the mean round."""

    def __init__(self, queue_depth):
        r = self.registry = CollectorRegistry()
        c = lambda name, doc, *labels: Counter(f"{PREFIX}_{name}", doc, labels, registry=r)  # noqa: E731
        self.requests = c("requests", "HTTP requests answered, by endpoint and status code", "endpoint", "status")
        self.generated = c("generated_tokens", "completion tokens generated")
        self.prompt = c("prompt_tokens", "prompt tokens of finished requests (prefilled + reused)")
        self.prefilled = c("prefill_tokens", "prompt tokens the target processed in a prefill forward")
        self.cached = c("cached_tokens", "prompt tokens whose K/V were reused from the cache (prefix reuse)")
        self.forwards = c("target_forwards", "target forwards (each streams the offloaded layers once)")
        self.bytes = c("bytes_streamed", "bytes of offloaded weights streamed from the offload tier")
        self.finished = c("finished_requests", "generation requests finished, by finish reason", "reason")
        self.rounds = c("rounds", "drafting rounds (a draft, then one verify forward)")
        self.round_seconds = c("round_seconds", "seconds of the rounds by phase: draft, verify, verify_wait (of the "
                               "verify, blocked on the offload tier)", "phase")
        self.disk_busy = c("disk_busy_seconds", "seconds the disk read for the offload tier, by the round's phase "
                           "it overlapped: draft (read-ahead), verify", "phase")
        self.tau = Gauge(f"{PREFIX}_tau", "acceptance length of the last finished request: new tokens / target "
                         "forwards (prefill counted)", registry=r)
        self.tau_all = Gauge(f"{PREFIX}_tau_overall", "generated tokens / target forwards since the start",
                             registry=r)
        depth = Gauge(f"{PREFIX}_queue_depth", "requests waiting for the engine (not counting the running one)",
                      registry=r)
        depth.set_function(queue_depth)
        buckets = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
        self.latency = Histogram(f"{PREFIX}_request_latency_seconds", "seconds from arrival to the last token",
                                 buckets=buckets, registry=r)
        self.first_token = Histogram(f"{PREFIX}_time_to_first_token_seconds", "seconds from arrival to the first "
                                     "token (queue wait + prefill)", buckets=buckets, registry=r)
        self._tokens = self._forwards = 0

    def finished_job(self, done) -> None:
        """Count a finished generation (a :class:`~subspec.server.jobs.Finished`)."""
        s = done.stats
        self.finished.labels(done.finish_reason).inc()
        self.generated.inc(done.completion_tokens)
        self.prompt.inc(done.prompt_tokens)
        self.prefilled.inc(s.get("prefill_tokens", 0))
        self.cached.inc(s.get("cached_tokens", 0))
        self.forwards.inc(s.get("target_forwards", 0))
        self.bytes.inc(s.get("bytes_streamed", 0))
        self.rounds.inc(s.get("rounds", 0))
        for phase in ("draft", "verify", "verify_wait"):
            self.round_seconds.labels(phase).inc(s.get(f"{phase}_seconds", 0.0))
        for phase in ("draft", "verify"):
            self.disk_busy.labels(phase).inc(s.get(f"{phase}_disk_seconds", 0.0))
        if s.get("target_forwards"):
            self.tau.set(s["tau"])
            self._tokens += done.completion_tokens
            self._forwards += s["target_forwards"]
            self.tau_all.set(self._tokens / self._forwards)

    def render(self) -> bytes:
        return generate_latest(self.registry)
