package incus

import "time"

// SetHandshakeTimeout shortens the websocket handshake's bound for the fake-server tests.
func (c *Client) SetHandshakeTimeout(d time.Duration) { c.ws.HandshakeTimeout = d }

// SetBeforeSockets runs f between each exec's POST and its websockets.
func (c *Client) SetBeforeSockets(f func()) { c.beforeSockets = f }
