"""Prometheus metrics under vLLM's names (vllm:...), so vLLM dashboards and scrapers read them as they are."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest

disable_created_metrics()  # no *_created series (each metric's creation time), which scrapers do not need

# Histogram buckets (seconds): from sub-millisecond GPU steps to slow CPU runs.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


class ServerMetrics:
    """The server's counters, gauges and histograms in their own registry; render() gives the text format.

    Counters show with the _total suffix, as vLLM's do (vllm:generation_tokens_total, ...). Each
    metric carries vLLM's labels model_name and engine ("0": one engine).
    """

    def __init__(self, model_name: str, num_speculative_tokens: int, kv_cache_tokens: int):
        self.kv_cache_tokens = kv_cache_tokens  # the target KV cache's positions: slots x max_model_len
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "engine": "0"}
        names = list(labels)

        def make(cls, name, doc, **kw):
            return cls(name, doc, names, registry=self.registry, **kw).labels(**labels)

        self.running = make(Gauge, "vllm:num_requests_running", "Requests in the engine's batch (holding a slot).")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Requests queued for a slot.")
        self.kv_cache_usage = make(Gauge, "vllm:kv_cache_usage_perc",
                                   "Fraction of the target KV cache's positions (slots x context) holding "
                                   "computed tokens of running requests (1 = full).")
        # Always 0: a running request keeps its slot and KV until it ends; kept for vLLM's dashboards.
        make(Counter, "vllm:num_preemptions", "Preemptions (none: a running request keeps its slot to the end).")
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Prompt tokens admitted.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Tokens generated.")
        self.ttft = make(Histogram, "vllm:time_to_first_token_seconds",
                         "Seconds from a request's arrival to its first token.", buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds",
                        "Seconds between a request's consecutive engine steps that gave it tokens.",
                        buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "vllm:e2e_request_latency_seconds",
                        "Seconds from a request's arrival to its end.", buckets=E2E_BUCKETS)
        self._success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                names + ["finished_reason"], registry=self.registry)
        self._labels = labels
        # vLLM's metric names; its "num_drafts" is minispec's num_spec_verifications (Request.num_drafts is
        # a request's pending draft tokens)
        self.num_spec_verifications = make(Counter, "vllm:spec_decode_num_drafts",
                                           "Verifications with at least one draft.")
        self.num_draft_tokens = make(Counter, "vllm:spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.num_accepted_tokens = make(Counter, "vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by draft position.",
                          names + ["position"], registry=self.registry)
        self.accepted_per_pos = [per_pos.labels(**labels, position=str(j)) for j in range(num_speculative_tokens)]

    def observe_queue(self, num_running: int, num_waiting: int, num_cached_tokens: int) -> None:
        """After a step: the requests running and waiting, and the tokens their KV cache holds."""
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_cache_usage.set(num_cached_tokens / self.kv_cache_tokens)

    def observe_prompt(self, num_tokens: int) -> None:
        self.prompt_tokens.inc(num_tokens)

    def observe_tokens(self, num_tokens: int, ttft_s: float | None = None, itl_s: float | None = None) -> None:
        """One step's tokens for one request: its first (ttft_s) or a later one (itl_s)."""
        self.generation_tokens.inc(num_tokens)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if itl_s is not None:
            self.itl.observe(itl_s)

    def observe_spec(self, num_spec_verifications: int, num_draft_tokens: int, num_accepted: int,
                     per_pos: list[int]) -> None:
        self.num_spec_verifications.inc(num_spec_verifications)
        self.num_draft_tokens.inc(num_draft_tokens)
        self.num_accepted_tokens.inc(num_accepted)
        for counter, n in zip(self.accepted_per_pos, per_pos):
            counter.inc(n)

    def observe_finish(self, reason: str, e2e_s: float) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()
        self.e2e.observe(e2e_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)
