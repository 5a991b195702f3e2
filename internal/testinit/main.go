// Command testinit is a tiny static init for scratch test containers.
//
// As PID 1 (or with no arguments) it sleeps forever, reaps zombies, and exits cleanly on
// SIGPWR, SIGTERM, SIGINT or SIGRTMIN+3, so `incus stop` is fast. (LXC sends SIGPWR, or
// SIGRTMIN+3 when init blocks that signal as systemd does, and as Go's runtime seems to.)
//
// Run with arguments (through `incus exec`), it is a small multi-call tool for tests:
//
//	testinit echo ARGS...        print ARGS joined by spaces, then a newline
//	testinit stderr ARGS...      the same on stderr
//	testinit exit N              exit with status N
//	testinit cat                 copy stdin to stdout
//	testinit tty                 print the name of stdin's terminal ("not a tty" if none), then "hi"
//	testinit env NAME            print the value of $NAME
//	testinit pwd                 print the working directory
//	testinit id                  print "uid gid"
//	testinit sleep SECONDS       sleep
//	testinit stat PATH           print "MODE(octal) UID GID" of PATH
//	testinit tag                 print the build tag (-X main.buildTag)
//
// Build it with CGO_ENABLED=0 so it runs in an empty rootfs.
package main

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// buildTag is stamped by tests (-X main.buildTag=...) so that each test package's image is
// distinct; "testinit tag" prints it.
var buildTag = "none"

func main() {
	if os.Getpid() == 1 || len(os.Args) < 2 {
		initMode()
		return
	}
	os.Exit(tool(os.Args[1], os.Args[2:]))
}

// sigRTMin3 is glibc's SIGRTMIN+3 (34+3). LXC sends it instead of SIGPWR to an init that
// blocks it, taking it for systemd; the Go runtime's threads do block the real-time signals,
// so a Go init must treat SIGRTMIN+3 as "halt" too or `incus stop` times out.
const sigRTMin3 = syscall.Signal(37)

func initMode() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGPWR, syscall.SIGTERM, syscall.SIGINT, syscall.SIGCHLD, sigRTMin3)
	for s := range sigs {
		if s == syscall.SIGCHLD {
			reap()
			continue
		}
		reap()
		os.Exit(0)
	}
}

func reap() {
	for {
		var ws syscall.WaitStatus
		pid, err := syscall.Wait4(-1, &ws, syscall.WNOHANG, nil)
		if pid <= 0 || err != nil {
			return
		}
	}
}

func tool(cmd string, args []string) int {
	switch cmd {
	case "stat":
		if len(args) != 1 {
			return 2
		}
		var st syscall.Stat_t
		if err := syscall.Stat(args[0], &st); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("%o %d %d\n", st.Mode&0o7777, st.Uid, st.Gid)
	case "tag":
		fmt.Println(buildTag)
	case "echo":
		fmt.Println(strings.Join(args, " "))
	case "stderr":
		fmt.Fprintln(os.Stderr, strings.Join(args, " "))
	case "exit":
		if len(args) != 1 {
			return 2
		}
		n, err := strconv.Atoi(args[0])
		if err != nil {
			return 2
		}
		return n
	case "cat":
		if _, err := io.Copy(os.Stdout, os.Stdin); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
	case "tty":
		fmt.Println(ttyName())
		fmt.Println("hi")
	case "env":
		if len(args) != 1 {
			return 2
		}
		fmt.Println(os.Getenv(args[0]))
	case "pwd":
		wd, err := os.Getwd()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Println(wd)
	case "id":
		fmt.Println(os.Getuid(), os.Getgid())
	case "sleep":
		if len(args) != 1 {
			return 2
		}
		d, err := strconv.ParseFloat(args[0], 64)
		if err != nil {
			return 2
		}
		time.Sleep(time.Duration(d * float64(time.Second)))
	default:
		fmt.Fprintf(os.Stderr, "testinit: unknown command %q\n", cmd)
		return 2
	}
	return 0
}

// ttyName names stdin's terminal, or says "not a tty".
func ttyName() string {
	var t syscall.Termios
	if _, _, e := syscall.Syscall(syscall.SYS_IOCTL, 0, syscall.TCGETS, uintptr(unsafe.Pointer(&t))); e != 0 {
		return "not a tty"
	}
	name, err := os.Readlink("/proc/self/fd/0")
	if err != nil {
		return "a tty"
	}
	return name
}
