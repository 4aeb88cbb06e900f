"""The HTTP edge: authentication, admission, enqueueing and SSE streaming."""
