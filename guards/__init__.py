"""What every script keeps to: a bad input is answered in one line (arguments), an output is written whole or not at
all (outputs) by one writer (writer_lock), and a signal stops it cleanly, loader workers included (stopping). The
standard library (Composer's ranks inside the one function that locks on rank 0): every other folder stands on this
one."""
