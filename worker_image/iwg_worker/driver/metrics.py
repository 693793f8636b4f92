"""The driver's Prometheus metrics: what the autoscaler reads and what people look at.

One registry per driver (not the process-global default), so tests can run several drivers in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
REPLICA_STATES = ("joining", "serving", "draining", "dead")


class DriverMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self._replica_states: dict[int, str] = {}  # the state last published per replica
        self.queue_depth = Gauge(
            "iwg_queue_depth", "Inputs waiting in the driver's queue for a batch slot", registry=r
        )
        self.queue_limit = Gauge(
            "iwg_queue_limit", "Inputs the queue admits before answering 429", registry=r
        )
        self.inflight_requests = Gauge(
            "iwg_inflight_requests", "HTTP inference requests admitted and not yet answered", registry=r
        )
        self.inflight_batches = Gauge(
            "iwg_inflight_batches", "Batches sent to replicas and not yet answered", ["replica"], registry=r
        )
        self.requests = Counter(
            "iwg_requests",
            "HTTP inference requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=r,
        )
        self.request_latency = Histogram(
            "iwg_request_latency_seconds",
            "Time from receiving a request to answering it",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_latency = Histogram(
            "iwg_batch_latency_seconds",
            "Time a replica took to answer a batch (transport included)",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait = Histogram(
            "iwg_queue_wait_seconds",
            "Time an input waited in the queue before its batch was sent",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "iwg_batch_size", "Inputs per batch sent to a replica", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.replica_state = Gauge(
            "iwg_replica_state",
            "1 for the state each replica is in, 0 otherwise",
            ["replica", "state"],
            registry=r,
        )
        self.serving_replicas = Gauge(
            "iwg_serving_replicas", "Replicas that receive batches (serving and not draining)", registry=r
        )
        self.batches = Counter("iwg_batches", "Batches sent, by replica", ["replica"], registry=r)
        self.retries = Counter(
            "iwg_batch_retries", "Batches retried on another replica after their replica failed", registry=r
        )
        self.request_retries = Counter(
            "iwg_request_retries",
            "Generation requests started again on another replica after theirs failed before any output",
            ["reason"],
            registry=r,
        )
        self.replica_failures = Counter(
            "iwg_replica_failures", "Batches whose replica died or timed out", ["replica"], registry=r
        )
        self.rejected = Counter(
            "iwg_rejected_requests", "Requests refused before batching, by reason", ["reason"], registry=r
        )
        self.max_batch_size = Gauge(
            "iwg_max_batch_size", "Current dynamic-batching max batch size", registry=r
        )
        self.max_wait_seconds = Gauge("iwg_max_wait_seconds", "Current dynamic-batching max wait", registry=r)

        self.activation_waiting = Gauge(
            "iwg_activation_waiting",
            "Requests held while no replica serves, waiting for one to start (activation)",
            registry=r,
        )
        self.activation_seconds = Histogram(
            "iwg_activation_seconds",
            "Time from a request's arrival with no replica serving to its first answer (first token if streamed)",
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0),
            registry=r,
        )
        self.last_activation_seconds = Gauge(
            "iwg_last_activation_seconds",
            "The latest activation: time from the first request held with no replica serving to the first "
            "answer of a held request (0 before any)",
            registry=r,
        )
        self.activation_phase_seconds = Histogram(
            "iwg_activation_phase_seconds",
            "Each activation's time to first answer in its parts (phase): pod_start (first request held to the "
            "worker process's start: scheduling, image, container), worker_start (to its model load's start: "
            "imports, device), model_load, ready (to serving: sockets, hello, the driver reaching it), "
            "first_answer (serving to the first answer: the first batch or engine step)",
            ["phase"],
            buckets=(0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0),
            registry=r,
        )
        self.last_activation_phase_seconds = Gauge(
            "iwg_last_activation_phase_seconds",
            "The latest activation's time to first answer in its parts (phase, as iwg_activation_phase_seconds)",
            ["phase"],
            registry=r,
        )
        self.last_activation_time = Gauge(
            "iwg_last_activation_timestamp_seconds",
            "When the latest activation's first answer came, Unix time (0 before any)",
            registry=r,
        )
        self.time_to_first_token = Histogram(
            "iwg_time_to_first_token_seconds",
            "Time from admitting a generation request to its first output",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "iwg_inter_token_latency_seconds",
            "Time between consecutive output tokens of a generation request",
            buckets=(0.001, 0.0025, *LATENCY_BUCKETS),
            registry=r,
        )
        self.requests_running = Gauge(
            "iwg_requests_running", "Generation requests in the engines' running batches", registry=r
        )
        self.requests_waiting = Gauge(
            "iwg_requests_waiting", "Generation requests the engines hold waiting for room", registry=r
        )
        self.kv_cache_usage = Gauge(
            "iwg_kv_cache_usage",
            "Share of a replica's KV cache blocks held by requests",
            ["replica"],
            registry=r,
        )

        self.routing_decisions = Counter(
            "iwg_routing_decisions",
            "Generation requests routed to each replica, by why: prefix (it holds the longest cached prefix), "
            "hash (no replica holds one: rendezvous hashing of the first block), bound (the preferred replica "
            "was at the load bound), least_loaded (policy leastLoaded)",
            ["replica", "reason"],
            registry=r,
        )
        self.routing_blocks_reported = Counter(
            "iwg_routing_blocks_reported",
            "Prompt block hashes a replica's engine reported stored or evicted (vLLM's KV cache events), which "
            "the routing table follows",
            ["replica", "event"],
            registry=r,
        )
        self.routing_table_blocks = Gauge(
            "iwg_routing_table_blocks",
            "Prompt block hashes the driver remembers for a replica (cache-aware routing)",
            ["replica"],
            registry=r,
        )
        self.prefix_cache_queries = Counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens the engines looked up in their prefix caches (vLLM's name)",
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens the engines found in their prefix caches (vLLM's name)",
            registry=r,
        )

        # The model-server signals the Gateway API Inference Extension's endpoint picker reads, under vLLM's names.
        self.vllm_running = Gauge(
            "vllm:num_requests_running", "Requests in the engines' running batches", registry=r
        )
        self.vllm_waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting for room in the engines", registry=r
        )
        self.vllm_kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage of the serving replicas, mean (0 to 1)", registry=r
        )

    def set_replica_state(self, replica: int, state: str) -> None:
        if self._replica_states.get(replica) == state:
            return  # unchanged (the router publishes at every claim and release of a replica)
        self._replica_states[replica] = state
        for s in REPLICA_STATES:
            self.replica_state.labels(replica=str(replica), state=s).set(1.0 if s == state else 0.0)

    def render(self) -> bytes:
        return bytes(generate_latest(self.registry))
