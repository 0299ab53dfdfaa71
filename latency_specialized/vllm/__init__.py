"""vLLM integration: ``--decode-backend latency_specialized`` and the decode override.

* ``plugin``       - vLLM general plugin entry point (``register()``): light, idempotent, lazy hooks.
* ``import_hook``  - run a patch when vLLM imports a module (keeps the front-end and --help light).
* ``engine_args``  - ``--decode-backend`` on EngineArgs, folded into ``additional_config``.
* ``config``       - the ``decode_backend`` key: values, precedence (env > flag > key > auto), and our
                     own ``additional_config["latency_specialized"]`` entry that carries the choice.
* ``worker``       - wraps the workers' ``load_model`` for deployments that asked for us.
* ``weights``      - the model's own weights through the CPU build's repack.
* ``scope``        - the deployment vs the adapter scope, gathered across ranks.
* ``install``      - find the adapter, check collectively, plan, bind, replace ``model.forward``.
* ``binding``      - the contract of an adapter's vLLM binding, the plans per bucket (SiteTable) and the
                     generic decode step (the runtime's ComposedProgram over vLLM's tensors).
* ``override``     - the per-step gate (pure decode in scope?) and dispatch, with the trace.
* ``trace_file``   - ``LATENCY_SPECIALIZED_TRACE_FILE``: the trace as JSON, per rank.

User documentation: ``docs/vllm.md``.
"""
