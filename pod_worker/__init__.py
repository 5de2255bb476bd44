"""The worker of one pod: its gRPC server, mesh, compiled steps and DCN gradient exchange."""
