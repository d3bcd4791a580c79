"""Django-free helpers shared by the web processes, the workers and the tooling."""
