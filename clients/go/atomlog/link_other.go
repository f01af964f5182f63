//go:build !unix

package atomlog

import "net"

// open: without a non-blocking peek here, a kept connection is taken as open (a closed
// one fails its call as SERVER_UNAVAILABLE, which callers retry).
func open(net.Conn) bool { return true }
