package incus

import "time"

// SetHandshakeTimeout shortens the websocket handshake's bound for the fake-server tests.
func (c *Client) SetHandshakeTimeout(d time.Duration) { c.ws.HandshakeTimeout = d }
