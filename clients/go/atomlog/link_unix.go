//go:build unix

package atomlog

import (
	"crypto/tls"
	"net"
	"syscall"
)

// open tells whether a kept link connection is still open. With no call under way the
// server sends nothing, so a peek that would block means open; end of stream (a restart,
// the server's idle limit) or anything to read (a TLS close_notify) means it was closed.
func open(conn net.Conn) bool {
	if secured, ok := conn.(*tls.Conn); ok {
		conn = secured.NetConn()
	}
	raw, ok := conn.(syscall.Conn)
	if !ok {
		return true
	}
	control, err := raw.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	control.Read(func(fd uintptr) bool {
		var one [1]byte
		_, _, err := syscall.Recvfrom(int(fd), one[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
		alive = err == syscall.EAGAIN || err == syscall.EWOULDBLOCK
		return true // never wait for readiness
	})
	return alive
}
