"""The engine host: where the worker's engine runs (a thread or a child process), behind one interface."""
