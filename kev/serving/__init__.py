"""What both services (bank_service, scorer_service) and the stack around them share, written once.

    settings.py      the settings loader: env/flag fields -> a frozen dataclass, ConfigError, the
                     redacted start-up log, the CUDA-graph plan from the graph settings
    errors.py        ServiceError and its subclasses, each carrying its gRPC status code
    grpc_server.py   GrpcServer: thread pool, message limits, health, reflection, binding the port
    processes.py     local processes: a private redis-server, the bank and scorer services (kev/stack.py
                     and the tests' harness start them through it)
    interpreter.py   CPython in a serving process: the start-up heap frozen out of GC, the GIL switch interval
    probe.py         `python -m kev.serving.probe`: one gRPC health check (Kubernetes exec probes)
"""
