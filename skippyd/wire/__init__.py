"""The stage-to-stage wire protocol (see skippy-protocol(7)).

``messages``  what travels: kinds, limits, message/reply/hello classes, stats
``codec``     the byte layout: pure encode/decode
``stream``    reading and writing frames on trio streams (deadlines, EOF)
``handshake`` hello exchange and its pure check
``errors``    the exceptions (all subclasses of WireError)
"""
