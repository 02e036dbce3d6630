"""What both server processes share: serving (start, bind, signals, shutdown), request
decoding, role checks, fault injection and health. Imports neither side.
"""
