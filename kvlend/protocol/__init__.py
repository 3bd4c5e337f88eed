"""The control protocol, sans-IO: wire messages, framing and the prefill and decode sessions."""
