"""Test harnesses: fault-injecting filesystem, crash harness, loopback metadata servers, reliability counts."""
