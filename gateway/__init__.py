"""HTTP front end (Starlette + Hypercorn): OpenAI protocol, auth, SSE, admission, metrics.
Never imports OpenVINO. Built by issue #4."""
