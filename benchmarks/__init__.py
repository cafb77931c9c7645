"""Scripts that print figures: speed sweep, framework overhead, loader throughput, EMA update, profile summary."""
