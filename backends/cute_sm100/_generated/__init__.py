"""Generated kernel modules (attnforge codegen); do not edit."""
