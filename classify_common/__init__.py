"""Code both layers share: generated stubs (in gen/), the error taxonomy, request
context, validation, logging and the server interceptor. Neither layer imports
the other; both import this."""
