"""The contract between the operator's pod builders and the processes in those pods.

The operator writes these environment variables; `iwg-worker` and `iwg-driver` read them. One list, so
neither side can drift from the other.
"""

from typing import Final

# Identity of the process within its group.
GROUP: Final = "IWG_GROUP"
NAMESPACE: Final = "IWG_NAMESPACE"
REPLICA: Final = "IWG_REPLICA"
RANK: Final = "IWG_RANK"
WORLD_SIZE: Final = "IWG_WORLD_SIZE"
POD_NAME: Final = "IWG_POD_NAME"
# Which creation of its rank a worker pod is (the operator numbers each new pod of a rank higher than the last):
# drivers accept hellos only from the newest incarnation of a rank they have seen, so a replaced process that
# comes back (a partitioned node, a resumed SIGSTOP) never serves again. Absent or 0: `iwg serve`, no fencing.
INCARNATION: Final = "IWG_INCARNATION"
# Which creation of its replica a worker pod belongs to: the ranks of a replica created together share it, and a
# replica torn down and created again gets a higher one. The ranks meet in torch.distributed's store under this
# epoch only, so a rank process of an earlier creation that comes back never meets, let alone joins a collective
# of, the ranks that replaced it. Absent or 0: `iwg serve`, the store's keys unprefixed.
REPLICA_EPOCH: Final = "IWG_REPLICA_EPOCH"
POD_IP: Final = "IWG_POD_IP"

# ZMQ wiring: the driver binds both, workers connect. Values are tcp://host:port (ipc:// locally).
RPC_ENDPOINT: Final = "IWG_RPC_ENDPOINT"  # driver -> workers: requests (rpc_broadcast_mq)
RESPONSE_ENDPOINT: Final = "IWG_RESPONSE_ENDPOINT"  # workers -> driver: hello, replies, heartbeats

# CURVE: a directory mounted from the group's Secret holding the process's own keypair as `curve.key` (secret,
# Z85) and `curve.pub` (public, Z85), and the other side's public key as `peer.pub`: the driver's pods get the
# driver's pair and the workers' public key, worker pods the workers' pair and the driver's public key. Any
# other key is refused. Without `peer.pub` every process holds the same pair (the one-keypair form).
CURVE_DIR: Final = "IWG_CURVE_DIR"
CURVE_SECRET_FILE: Final = "curve.key"
CURVE_PUBLIC_FILE: Final = "curve.pub"
CURVE_PEER_FILE: Final = "peer.pub"

# Liveness of the ZMQ link: workers and driver send heartbeats this often; a peer silent for
# HEARTBEAT_MISSES intervals is gone.
HEARTBEAT_INTERVAL: Final = "IWG_HEARTBEAT_INTERVAL_S"
DEFAULT_HEARTBEAT_INTERVAL_S: Final = 1.0
DEFAULT_HEARTBEAT_MISSES: Final = 3

# A driver told to stop (SIGTERM) serves DRIVER_LAME_DUCK more seconds (spec.driver.lameDuckSeconds; each answer
# closing its connection), then finishes the requests it admitted for at most DRIVER_DRAIN_S; its pod's grace
# period covers both. DEFAULT_DRIVER_LAME_DUCK_S when the variable is unset.
DRIVER_LAME_DUCK: Final = "IWG_DRIVER_LAME_DUCK_S"
DEFAULT_DRIVER_LAME_DUCK_S: Final = 5.0
DRIVER_DRAIN_S: Final = 30.0

# A worker told to stop by SIGTERM (an eviction, a deleted pod) drains: its heartbeats say so at once (the
# drivers send its replica nothing new), and a generation worker serves on until its replica runs nothing, for at
# most WORKER_DRAIN_S (then what still runs is cut), before its goodbye. Its pod's grace period is that plus
# WORKER_GRACE_AFTER_DRAIN_S, the time a worker takes to stop after the goodbye (engine shutdown included).
WORKER_DRAIN_S: Final = 30.0
WORKER_GRACE_AFTER_DRAIN_S: Final = 20

# How many messages a worker's ZMQ socket to one driver queues before a send finds no room (ZMQ's send high-water
# mark; past it the worker's own backlog, MAX_BACKLOG in worker_proc.py, then drops for a driver that is lost).
# The operator leaves it at ZMQ's default.
SEND_QUEUE: Final = "IWG_SEND_QUEUE"
DEFAULT_SEND_QUEUE: Final = 1000

# Benchmarks only: allow tcp without CURVE ("1"). Never set by the operator.
INSECURE_TCP: Final = "IWG_INSECURE_TCP"

# HTTP for kubelet probes and the operator's prober: /healthz /readyz /metrics.
HEALTH_PORT: Final = "IWG_HEALTH_PORT"
DEFAULT_HEALTH_PORT: Final = 8080

# torch.distributed rendezvous for world size > 1 (rank 0's per-pod DNS name via the headless Service).
MASTER_ADDR: Final = "MASTER_ADDR"
MASTER_PORT: Final = "MASTER_PORT"
TORCH_RANK: Final = "RANK"
TORCH_WORLD_SIZE: Final = "WORLD_SIZE"
# Why a worker ended (a failed start names its cause, e.g. a model that cannot be sharded worldSize ways): the
# kubelet reads it into the container's terminated state, which the operator shows on the group.
TERMINATION_MESSAGE_PATH: Final = "/dev/termination-log"
# The line of the message (or of the log's end) that holds the reason.
START_FAILURE_PREFIX: Final = "worker failed to start: "
# Which of the GPUs this process sees is its own (the CUDA device index; transformers reads it too).
LOCAL_RANK: Final = "LOCAL_RANK"
DEFAULT_MASTER_PORT: Final = 29500

# The model and the worker classes.
MODEL_TASK: Final = "IWG_MODEL_TASK"  # embed | generate
MODEL_PATH: Final = "IWG_MODEL_PATH"
SERVED_NAME: Final = "IWG_SERVED_NAME"
KV_CACHE_BLOCKS: Final = "IWG_KV_CACHE_BLOCKS"  # generate: KV cache size in blocks
KV_CACHE_MEMORY_FRACTION: Final = "IWG_KV_CACHE_MEMORY_FRACTION"  # or a fraction of free device memory
DTYPE: Final = "IWG_DTYPE"  # auto | float32 | float16 | bfloat16
ENGINE: Final = "IWG_ENGINE"  # generate: auto | vllm | transformers
CHAT_TEMPLATE: Final = "IWG_CHAT_TEMPLATE"  # a Jinja chat template that replaces the model's own
ENFORCE_EAGER: Final = "IWG_ENFORCE_EAGER"  # "1": vLLM runs the model eagerly (no torch.compile warm-up)
DEVICE: Final = "IWG_DEVICE"  # auto | cuda | cpu
WORKER_CLS: Final = "IWG_WORKER_CLS"
WORKER_EXTENSION_CLS: Final = "IWG_WORKER_EXTENSION_CLS"

# Driver only.
REPLICAS: Final = "IWG_REPLICAS"
HTTP_PORT: Final = "IWG_HTTP_PORT"
HTTP_HOST: Final = "IWG_HTTP_HOST"  # address the driver's HTTP server binds; all interfaces when unset
MAX_BATCH_SIZE: Final = "IWG_MAX_BATCH_SIZE"
MAX_WAIT_MS: Final = "IWG_MAX_WAIT_MS"
MAX_QUEUE: Final = "IWG_MAX_QUEUE"
ADMIN_TOKEN_FILE: Final = "IWG_ADMIN_TOKEN_FILE"
ROUTING_POLICY: Final = "IWG_ROUTING_POLICY"  # generate: cacheAware | leastLoaded
ROUTING_LOAD_BOUND: Final = "IWG_ROUTING_LOAD_BOUND"  # cacheAware: epsilon of the load bound
# > 0: hold requests this many seconds while no replica serves (scale from zero); 0 or unset: answer 503
ACTIVATION_TIMEOUT: Final = "IWG_ACTIVATION_TIMEOUT_S"

# Ports the operator opens on pods and Services.
DEFAULT_RPC_PORT: Final = 5555
DEFAULT_RESPONSE_PORT: Final = 5556
DEFAULT_HTTP_PORT: Final = 8000
