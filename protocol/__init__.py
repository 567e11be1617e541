"""Wire types and sockets shared by every process. Nothing else imports zmq; nothing here imports argparse (the
command line is frontend/entrypoints/cli.py) or another loraplex package but protocol/.

structs.py          every struct that crosses a process boundary, one tagged union per socket direction
sockets.py, curve.py  typed ZeroMQ sockets; CURVE keys on TCP sockets (with curve_store.py, the only modules that
                    import zmq)
curve_store.py      the multi-node rendezvous store behind the cluster key (TCPStore's operations over CURVE)
rpc.py              the internal RPC wire format, for clients in any language
config.py           ServerConfig: every launch setting with its help, validated once (the CLI is generated from it)
pooling.py          PoolingSpec: the pooling runner's task, pooling and head, from the flags and the checkpoint
speculative.py      SpeculativeConfig: --speculative-config and SGLang's spellings, validated once
spec_stats.py       speculative decoding's counts per adapter, summed over replicas, with their rates
model_ref.py        what a model path names: a local dir, an HF-cache snapshot or a Hub id
quantization.py     which quantization a checkpoint is served with
mrope.py            Qwen-VL's three-row rotary positions of a prompt with images
request_limits.py   the one rule of a request's size, at the edge and in the scheduler
grammar.py          what an OutputConstraint means (xgrammar's compile)
errors.py           an error's kind -> its HTTP status
proc.py, faults.py  child start-up (arguments, parent death, logging); test-only faults
cpu_cores.py        CorePlan: each CPU worker's threads and pinned cores, the cores the frontend and scheduler keep to
mathutil.py         cdiv
adapters/           PEFT adapters as every process reads them (config, files, targets, TP shards, merged outcomes)
"""
