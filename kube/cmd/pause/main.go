// Command pause is the pod sandbox's process for the local test cluster: the upstream pause
// image comes from a registry the test machines cannot reach. Like upstream's pause.c it sleeps
// until SIGINT/SIGTERM and reaps the zombies a shared pid namespace hands it.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range sigs {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
