"""Operating the service: the embedded stack, the demo, chaos runs, metrics, reports, timelines."""
